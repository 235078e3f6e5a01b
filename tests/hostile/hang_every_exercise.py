# class: hang
# base: stub
# expect: 0
# every function spins: the total time limit must hold


def spin(*args, **kwargs):
    while True:
        pass


project_qkv = attention_scores = stable_softmax = attend = causal_mask = padding_mask = spin
apply_mask = self_attention = compare_with_sdpa = exercise_1_shapes = exercise_2 = exercise_3_first_row = spin
