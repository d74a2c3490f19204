"""The careful hand-written baseline the platform must beat: one MLP, multi-positive InfoNCE, all images, 3 seeds.

Self-contained on purpose (numpy + torch only, nothing from latentsweep): what a student writes in 40 lines.
Usage: python benchmarks/reference_script.py TRAIN.npz TEST.npz OUT.csv [--seeds 3] [--epochs 40]
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("train"), p.add_argument("test"), p.add_argument("out")
    p.add_argument("--seeds", type=int, default=3), p.add_argument("--epochs", type=int, default=40)
    a = p.parse_args(argv)
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


if __name__ == "__main__":
    main()
