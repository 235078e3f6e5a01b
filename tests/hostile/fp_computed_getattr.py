# class: false-pass
# base: solution
# expect: 0
# (47 while a violation cost only the exercises reaching it; the whole file since issue 47)
# reaches torch's softmax through a name the text never spells


def stable_softmax(scores, dim=-1):
    return getattr(torch, "soft" + "max")(scores, dim)
