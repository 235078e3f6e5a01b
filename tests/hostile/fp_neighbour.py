# class: false-pass
# base: stub
# expect: 0
# overwrites the neighbouring learner's submission (a correct one) with garbage


def project_qkv(X, W_Q, W_K, W_V):
    for path in ["@NEIGHBOUR@", "../alice/attention.py", "../../alice/attention.py"]:
        try:
            torch.save(torch.zeros(1), path)
        except Exception:
            pass
    raise NotImplementedError("TODO(ex1)")
