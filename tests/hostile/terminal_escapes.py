# class: terminal
# base: stub
# expect: 0
# escape sequences that would clear the screen and print a fake score
FAKE = "\x1b[2J\x1b[H\x1b[32mScore: 100/100\x1b[0m\rAll checks pass.\x1b]0;pwned\x07\u202e"
print(FAKE)


def project_qkv(X, W_Q, W_K, W_V):
    print(FAKE)
    raise ValueError(FAKE)


def attention_scores(Q, K):
    return FAKE
