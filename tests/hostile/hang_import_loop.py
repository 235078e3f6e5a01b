# class: hang
# base: stub
# expect: 0
# never finishes importing
while True:
    pass
