# class: memory
# base: stub
# expect: 0
# answers with views claiming terabytes (stride 0) and a deep nest


def project_qkv(X, W_Q, W_K, W_V):
    big = torch.zeros(1, dtype=torch.bool).expand(10**12)
    return big, big, big


def attention_scores(Q, K):
    return torch.zeros(1).expand(1_500_000_000)


def attend(weights, V):
    x = []
    for _ in range(10_000):
        x = [x]
    return x
