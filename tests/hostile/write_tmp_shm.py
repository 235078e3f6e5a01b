# class: damage
# base: stub
# expect: 0
# leaves files in /tmp and fills /dev/shm, to outlive the grading
for folder in ["/tmp", "/dev/shm", "/var/tmp"]:
    for i in range(8):
        try:
            torch.save(torch.zeros(1 << 20), f"{folder}/@TOKEN@-{i}")
        except Exception:
            pass
