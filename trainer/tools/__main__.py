from trainer.tools import main

main()
