# class: false-pass
# base: solution
# expect: 67
# ex9 claims a perfect match while the learner's own layer cannot be measured


def self_attention(X, W_Q, W_K, W_V, mask=None):
    raise RuntimeError("not today")


def compare_with_sdpa(X, W_Q, W_K, W_V, mask=None):
    return 0.0
