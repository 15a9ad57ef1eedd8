"""`python -m diffgemma.cli` (tests, torchrun): the `diffgemma` command."""

from diffgemma.cli import main

if __name__ == "__main__":
    main()
