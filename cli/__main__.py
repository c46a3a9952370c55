"""``python -m k3rocm.cli`` (what ``torchrun ... -m k3rocm.cli bench ...`` starts on every rank)."""

from k3rocm.cli.main import main

main()
