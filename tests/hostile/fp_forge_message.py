# class: false-pass
# base: stub
# expect: 0
# writes a hand-made "all passed" message into every inherited file descriptor, then exits
import io

buf = io.BytesIO()
torch.save({"status": "ok", "results": [5], "violations": []}, buf)
for fd in range(3, 64):
    try:
        torch.os.write(fd, buf.getvalue())
    except OSError:
        pass
torch.os._exit(0)
