"""attnlab.flex: attention variants with FlexAttention's names, forward and backward on the CPU.

    from attnlab.flex import create_block_mask, flex_attention, sliding_window, alibi

    block_mask = create_block_mask(sliding_window(256), None, None, L, L)   # print(block_mask): a picture
    out = flex_attention(q, k, v, score_mod=alibi(H), block_mask=block_mask)
    out.sum().backward()                                                    # grads for q, k, v

Code written for ``torch.nn.attention.flex_attention`` runs unchanged with these names
(mask_mod / score_mod signatures, ``BLOCK_SIZE``, ``enable_gqa``, ``return_lse``, ``return_aux``,
``kernel_options``, BlockMask's attributes and methods, ``create_mask``); unlike
torch's on the CPU it has a backward and needs no compilation. Modules: :mod:`.block_mask`
(which tiles to skip, computed chunk by chunk), :mod:`.attention` (the tiled online softmax
over the visited blocks, pure-PyTorch), :mod:`.kernels` (the native block-sparse kernels it
uses for float32 without a score_mod or with alibi / softcap / relative_bias),
:mod:`.mods` (ready mask and score mods), :mod:`.varlen` (packed sequences).
"""

from attnlab.flex.attention import AuxOutput, AuxRequest, flex_attention
from attnlab.flex.block_mask import BlockMask, create_block_mask, create_mask
from attnlab.flex.mods import (alibi, and_masks, causal_mask, document_ids, document_mask, document_mask_from_lengths,
                               noop_mask, or_masks, prefix_lm, relative_bias, sliding_window, softcap)
from attnlab.flex.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                 flash_attn_varlen_qkvpacked_func, pad_input, unpad_input, varlen_attention)

__all__ = ["flex_attention", "AuxRequest", "AuxOutput", "create_block_mask", "create_mask", "BlockMask",
           "varlen_attention", "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "unpad_input", "pad_input", "causal_mask", "sliding_window",
           "document_mask", "document_mask_from_lengths", "document_ids", "prefix_lm", "and_masks", "or_masks",
           "noop_mask", "alibi", "softcap", "relative_bias"]
