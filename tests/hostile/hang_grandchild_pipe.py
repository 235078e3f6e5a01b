# class: hang
# static: refused
# base: solution
# expect: 0
# a grandchild keeps the result pipe open forever; the answer itself is right (the allow-list refuses
# torch.multiprocessing in project_qkv, which refuses the whole file since issue 47; the harness
# still runs the code straight in the sandbox)


_project = project_qkv


def project_qkv(X, W_Q, W_K, W_V):
    ctx = torch.multiprocessing.get_context("fork")
    never = ctx.SimpleQueue()
    ctx.Process(target=never.get, daemon=False).start()  # blocks forever, holding the inherited pipes
    return _project(X, W_Q, W_K, W_V)
