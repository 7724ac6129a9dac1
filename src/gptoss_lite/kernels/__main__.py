"""`python -m gptoss_lite.kernels`: which path each native kernel takes on this machine (`report`)."""

from gptoss_lite.kernels import report

for key, value in report().items():
    print(f"{key:>10}  {value}")
