# class: false-pass
# base: solution
# expect: 0
# walks from a tuple to every class in the interpreter (the classic sandbox escape)
LOADERS = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "BuiltinImporter"]
