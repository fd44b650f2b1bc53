"""What `train.py` and `train_with_fleet.py` share, so that their diff is the conversion only:
flags (`config`), the ImageNet-list data and its transforms (`data`), the learning-rate schedule
(`schedule`), progress output, top-k counts and the curves (`progress`)."""
