"""Train a Keras CNN on an lmdbstore store with ``model.fit``: the training loop a Keras user already has,
on any Keras backend (TensorFlow, JAX or torch), reading the store through ``lmdbstore.keras_dataset``
(or ``lmdbstore.tf_dataset`` with ``--tf-data`` on TensorFlow).

    lmdbstore ingest demo.lmdb --synthetic 100000                 # the demo's store (or your own)
    KERAS_BACKEND=tensorflow python examples/keras_fit.py demo.lmdb --epochs 3
    KERAS_BACKEND=torch python examples/keras_fit.py demo.lmdb --epochs 3

Every epoch reads the training split in a new random order (the store's own shuffle: every sample once per
epoch), validates on the held-out split ``lmdbstore train`` uses, and the model is the small CNN of
``lmdbstore train`` (conv-BN-ReLU blocks, global average pooling) with a one-cycle-like learning rate
(warm-up, then cosine decay).  The ``if __name__ == "__main__":`` guard matters: with TensorFlow or JAX
loaded, the reader processes start by ``forkserver``, which imports this file again.
"""

from __future__ import annotations

import argparse
import time

import lmdbstore


def build_model(keras, shape: tuple[int, ...], classes: int, width: int):  # type: ignore[no-untyped-def]
    """The CNN of ``lmdbstore train`` in Keras: (H, W, C) inputs, ``classes`` logits."""
    layers = keras.layers

    def block(x, filters):  # type: ignore[no-untyped-def]
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        # momentum 0.9 is PyTorch's 0.1: with Keras' 0.99 the running statistics need many more than the
        # 66 steps of 3 epochs at batch 4096 to settle, and validation lags far behind training
        return layers.ReLU()(layers.BatchNormalization(momentum=0.9)(x))

    inputs = keras.Input(shape)
    x = layers.MaxPooling2D()(block(inputs, width))
    x = layers.MaxPooling2D()(block(x, 2 * width))
    x = layers.GlobalAveragePooling2D()(block(x, 4 * width))
    outputs = layers.Dense(classes)(layers.Dropout(0.1)(x))
    return keras.Model(inputs, outputs)


def main() -> None:
    p = argparse.ArgumentParser(description="model.fit on an lmdbstore store")
    p.add_argument("store")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--tf-data", action="store_true", help="read through lmdbstore.tf_dataset (TensorFlow backend)")
    a = p.parse_args()

    import keras

    make = lmdbstore.tf_dataset if a.tf_data else lmdbstore.keras_dataset
    train = make(a.store, split="train", batch_size=a.batch, workers=a.workers)
    val = make(a.store, split="val", batch_size=a.batch, workers=1)
    with lmdbstore.open_reader(a.store) as reader:
        shape, classes = reader.shape, reader.classes
    item = (*shape, 1) if len(shape) == 2 else (shape[1], shape[2], shape[0])  # channels last

    steps = a.epochs * len(train)
    warmup = max(1, int(0.15 * steps))
    schedule = keras.optimizers.schedules.CosineDecay(
        a.lr / 25, decay_steps=steps - warmup, warmup_target=a.lr, warmup_steps=warmup, alpha=1e-3
    )
    model = build_model(keras, item, len(classes), a.width)
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    t0 = time.perf_counter()
    history = model.fit(train, validation_data=val, epochs=a.epochs, verbose=2)
    print(
        f"backend {keras.backend.backend()}: validation accuracy {history.history['val_accuracy'][-1]:.4f} "
        f"after {a.epochs} epochs in {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
