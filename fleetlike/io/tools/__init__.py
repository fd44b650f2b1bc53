"""TI-ACC's data tools: ``python -m fleetlike.io.tools.image_list`` (an image list from a class
folder tree) and ``python -m fleetlike.io.tools.img2tfrecord`` (the list packed into TFRecord
files and their index, read by `fleetlike.io.IndexTFRDataset`).

Example:
    $ python -m fleetlike.io.tools.image_list --img_dir val_demo/ --img_list val_list
    $ python -m fleetlike.io.tools.img2tfrecord --img_dir val_demo --img_list val_list \\
          --tfrecords_name val_demo --dataset_type ImageFold --workers 4
"""

__all__: list[str] = []
