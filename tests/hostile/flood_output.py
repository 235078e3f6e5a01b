# class: hang
# base: stub
# expect: 0
# prints without end at import and in an exercise


def project_qkv(X, W_Q, W_K, W_V):
    while True:
        print("x" * 10_000)
