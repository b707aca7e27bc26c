import sys

from megaloop.gpu_check.main import main

if __name__ == "__main__":
    sys.exit(main())
