"""Alias kept for ``python -m trainer.summarize``: the tool lives in ``trainer.tools.summarize`` (``packfsdp summarize``)."""

if __name__ == "__main__":
    from trainer.tools.summarize import main

    main()
