"""Character-level data in nanoGPT's flat format: ``train.bin``/``val.bin`` + ``meta.pkl``.

    python examples/gpt_flat/prepare.py --input corpus.txt --out data/

The same layout as nanoGPT's ``data/shakespeare_char/prepare.py`` (and llm.c and their many
forks): every character is one ``uint16`` id, the first 90% of the text is ``train.bin``, the
rest ``val.bin``, and ``meta.pkl`` holds ``vocab_size``, ``itos`` and ``stoi``.
"""

import argparse
import os
import pickle

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--input", required=True, help="a UTF-8 text file")
    p.add_argument("--out", required=True, help="directory for train.bin, val.bin, meta.pkl")
    a = p.parse_args()
    with open(a.input, encoding="utf-8") as f:
        data = f.read()
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = dict(enumerate(chars))
    n = len(data)
    os.makedirs(a.out, exist_ok=True)
    for name, part in (("train", data[: int(n * 0.9)]), ("val", data[int(n * 0.9) :])):
        ids = np.array([stoi[c] for c in part], dtype=np.uint16)
        ids.tofile(os.path.join(a.out, f"{name}.bin"))
        print(f"{name}.bin: {len(ids):,} tokens")
    with open(os.path.join(a.out, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)


if __name__ == "__main__":
    main()
