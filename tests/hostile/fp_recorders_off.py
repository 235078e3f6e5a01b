# class: false-pass
# base: solution
# expect: 0
# (47 while a violation cost only the exercises reaching it; the whole file since issue 47)
# turns torch's function-mode recorders off around the call (a private torch API)


def stable_softmax(scores, dim=-1):
    with torch._C.DisableTorchFunction():
        return torch.softmax(scores, dim)
