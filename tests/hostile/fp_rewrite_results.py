# class: false-pass
# base: stub
# expect: 0
# a process that outlives the exercise and keeps rewriting results.json with a full score


def rewrite_forever():
    while True:
        try:
            torch.save({"score": 100}, "@RESULTS@")
        except Exception:
            pass


for _ in range(2):
    torch.multiprocessing.get_context("fork").Process(target=rewrite_forever, daemon=False).start()
