# class: false-pass
# base: solution
# expect: 47
# reaches torch's softmax through a name the text never spells


def stable_softmax(scores, dim=-1):
    return getattr(torch, "soft" + "max")(scores, dim)
