# class: crash
# base: stub
# expect: 0
# lone surrogates and NUL bytes in everything the grader prints or stores
print("\ud800 half a character \x00 and a NUL")


def project_qkv(X, W_Q, W_K, W_V):
    raise ValueError("\udfff\ud800 broken text \x00")


def attention_scores(Q, K):
    return {"\ud800": "\udc00" * 10_000}
