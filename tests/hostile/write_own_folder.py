# class: damage
# static: refused
# base: solution
# expect: 0
# rewrites its own file and plants files next to it (the learner's real folder)
for path in ["@SELF_DIR@/attention.py", "@SELF_DIR@/planted-@TOKEN@", "attention.py", "../attention.py"]:
    try:
        torch.save(torch.zeros(1), path)
    except Exception:
        pass
