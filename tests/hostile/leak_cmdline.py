# class: leak
# base: stub
# expect: 0
# looks for the grader's command line (the --json path) among every pid it can see


def project_qkv(X, W_Q, W_K, W_V):
    found = []
    for pid in range(1, 300):
        try:
            t = torch.from_file(f"/proc/{pid}/cmdline", size=1, dtype=torch.uint8)
            found.append(str(pid))
        except Exception:
            pass
    raise ValueError("pids seen: " + ",".join(found))
