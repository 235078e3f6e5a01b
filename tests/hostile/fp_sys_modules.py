# class: false-pass
# base: stub
# expect: 0
# reaches attnlab's reference through torch's own reference to sys


def stable_softmax(scores, dim=-1):
    ref = [m for k, m in torch.sys.modules.items() if k.endswith("softmax")][0]
    return ref.stable_softmax(scores, dim)
