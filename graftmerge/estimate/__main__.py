"""``python -m graftmerge.estimate estimate ...`` (handy as ``torchrun -m graftmerge.estimate``)."""

from graftmerge.cli.fisher import fisher

if __name__ == "__main__":
    fisher()
