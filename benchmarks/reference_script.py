"""The careful hand-written baseline the platform must beat: one MLP, multi-positive InfoNCE, all images, 3 seeds.

Self-contained on purpose (numpy + torch only, nothing from latentsweep): what a student writes in 40 lines.
Usage: python benchmarks/reference_script.py TRAIN.npz TEST.npz OUT.csv [--seeds 3] [--epochs 40]
       python benchmarks/reference_script.py --smoke     # 1 seed, 1 epoch on tiny random files in a temp dir (tests)
"""
import argparse
import os
import tempfile


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("train", nargs="?"), p.add_argument("test", nargs="?"), p.add_argument("out", nargs="?")
    p.add_argument("--seeds", type=int, default=3), p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="1 seed, 1 epoch on tiny random files in a temp dir")
    a = p.parse_args(argv)
    if a.smoke:
        return smoke()
    if a.out is None:
        p.error("TRAIN, TEST and OUT are required (or --smoke)")
    import numpy as np  # here, not at the top: --help answers without loading torch
    import torch
    import torch.nn.functional as F

    z, t = np.load(a.train), np.load(a.test)
    x = torch.tensor(z["captions/embeddings"], dtype=torch.float32)
    img = torch.tensor(np.argmax(z["captions/label"], axis=1))  # caption -> image index
    y = F.normalize(torch.tensor(z["images/embeddings"], dtype=torch.float32), dim=1)
    xt = torch.tensor(t["captions/embeddings"], dtype=torch.float32)
    preds = []
    for seed in range(a.seeds):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 1024), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                  torch.nn.Linear(1024, y.shape[1]))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for _ in range(a.epochs):
            for idx in torch.randperm(len(x)).split(256):
                uniq, inv = torch.unique(img[idx], return_inverse=True)
                logits = F.normalize(net(x[idx]), dim=1) @ y[uniq].T / 0.05  # [B, U]: all captions of an image
                pos = (inv[None, :] == torch.arange(len(uniq))[:, None]).float()  # [U, B] positives per image
                i2c = -(logits.T.log_softmax(1) * pos).sum(1) / pos.sum(1)
                loss = 0.5 * (F.cross_entropy(logits, inv) + i2c.mean())
                opt.zero_grad(), loss.backward(), opt.step()
        net.eval()
        with torch.no_grad():
            preds.append(F.normalize(net(xt), dim=1))
    pred = F.normalize(torch.stack(preds).mean(0), dim=1).numpy()
    with open(a.out, "w") as fh:
        fh.write("id,embedding\n")
        for i, row in zip(t["captions/ids"], pred):
            fh.write(f'{i},"[{", ".join(f"{v:.6f}" for v in row)}]"\n')


def smoke():
    """The whole script on random challenge-shaped files (40 images x 3 captions, 16 -> 24) in a temp dir."""
    import numpy as np

    rng = np.random.default_rng(0)
    n_img, n_cap = 40, 120
    with tempfile.TemporaryDirectory(prefix="reference-smoke-") as tmp:
        train, test, out = (os.path.join(tmp, f) for f in ("train.npz", "test.npz", "out.csv"))
        np.savez(train, **{"captions/embeddings": rng.standard_normal((n_cap, 16), dtype=np.float32),
                           "captions/label": np.eye(n_img, dtype=bool)[np.arange(n_cap) % n_img],
                           "images/embeddings": rng.standard_normal((n_img, 24), dtype=np.float32)})
        np.savez(test, **{"captions/ids": np.arange(1, 11), "captions/embeddings": rng.standard_normal(
            (10, 16), dtype=np.float32)})
        main([train, test, out, "--seeds", "1", "--epochs", "1"])
        with open(out) as fh:
            print(f"smoke: wrote {sum(1 for _ in fh) - 1} rows")


if __name__ == "__main__":
    main()
