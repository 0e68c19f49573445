"""Alias kept for ``python -m trainer.summarize``: the tool lives in ``trainer.tools.summarize``
(``packfsdp summarize``)."""

from trainer.tools.summarize import main

if __name__ == "__main__":
    main()
