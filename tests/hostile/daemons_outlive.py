# class: leftovers
# static: refused
# base: solution
# expect: 0
# leaves processes behind at import and in every exercise; the answers themselves are right


def linger():
    while True:
        pass


ctx = torch.multiprocessing.get_context("fork")
never = ctx.SimpleQueue()
ctx.Process(target=linger, daemon=True).start()  # one spins
for _ in range(2):
    ctx.Process(target=never.get, daemon=False).start()  # two wait forever
