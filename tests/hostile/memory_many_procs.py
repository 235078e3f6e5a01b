# class: memory
# base: stub
# expect: 0
# four processes each holding ~900 MB: the cap must hold for the submission, not per process


def hog():
    x = torch.ones(225_000_000)
    while True:
        x += 1


def project_qkv(X, W_Q, W_K, W_V):
    procs = [torch.multiprocessing.get_context("fork").Process(target=hog) for _ in range(4)]
    for p in procs:
        p.start()
    hog()
