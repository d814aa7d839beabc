"""`deepspeed train.py --config configs/tiny.yaml [key=value ...]` — see dflash_fast.trainer."""
from dflash_fast.trainer import main

if __name__ == "__main__":
    main()
