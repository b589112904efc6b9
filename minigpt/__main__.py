"""`python -m minigpt` (and `torchrun -m minigpt train ...`) run the same CLI as `minigpt`."""

from minigpt.cli import main

if __name__ == "__main__":
    main()
