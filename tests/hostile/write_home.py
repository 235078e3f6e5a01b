# class: damage
# base: stub
# expect: 0
# plants files in the grader's home folder
for name in [".bashrc", ".profile", "planted-@TOKEN@"]:
    try:
        torch.save({"pwned": True}, "@HOME@/" + name)
    except Exception:
        pass
