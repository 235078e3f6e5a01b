# class: false-pass
# base: none
# expect: 0
# attnlab's own reference answers every exercise
import torch
from attnlab.functional import attention_weights, scaled_dot_product_attention
from attnlab.softmax import stable_softmax  # noqa: F401
from attnlab import masks


def causal_mask(T):
    return masks.causal(T, T)


def self_attention(X, W_Q, W_K, W_V, mask=None):
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    w = attention_weights(Q, K, attn_mask=mask)
    return w @ V, w
