# class: false-pass
# base: solution
# expect: 0
# switches the from-scratch recorders off by patching the policy module, then uses torch's softmax
import attnlab.grading.sandbox.recorder as policy

policy.banned = lambda names: []


def stable_softmax(scores, dim=-1):
    return torch.softmax(scores, dim)
