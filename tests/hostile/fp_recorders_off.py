# class: false-pass
# base: solution
# expect: 47
# turns torch's function-mode recorders off around the call (a private torch API)


def stable_softmax(scores, dim=-1):
    with torch._C.DisableTorchFunction():
        return torch.softmax(scores, dim)
