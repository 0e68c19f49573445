"""Alias kept for ``python -m trainer.variability``: the tool lives in ``trainer.tools.variability``
(``packfsdp variability``)."""

from trainer.tools.variability import main

if __name__ == "__main__":
    main()
