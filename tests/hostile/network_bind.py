# class: network
# base: stub
# expect: 0
# opens a port on the grader's machine and waits for someone to connect


def project_qkv(X, W_Q, W_K, W_V):
    store = torch.distributed.TCPStore("127.0.0.1", @PORT@, 2, True, wait_for_workers=False)
    while True:
        store.set("alive", "yes")
