# class: hang
# base: solution
# expect: 100
# a grandchild keeps the result pipe open forever; the answer itself is right


_project = project_qkv


def project_qkv(X, W_Q, W_K, W_V):
    ctx = torch.multiprocessing.get_context("fork")
    never = ctx.SimpleQueue()
    ctx.Process(target=never.get, daemon=False).start()  # blocks forever, holding the inherited pipes
    return _project(X, W_Q, W_K, W_V)
