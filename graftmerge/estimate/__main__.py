"""``python -m graftmerge.estimate estimate ...`` (handy as ``torchrun -m graftmerge.estimate``)."""

from graftmerge.estimate.cli import fisher

if __name__ == "__main__":
    fisher()
