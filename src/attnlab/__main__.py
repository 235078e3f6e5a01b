import sys

from attnlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
