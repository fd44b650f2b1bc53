"""`main.py` (PyTorch's official MNIST example on synthetic data) converted to fleetlike.

The whole conversion (`diff main.py main_fleet.py`; tests/test_examples_diff.py checks that it is
nothing more):

1. import: `from fleetlike import fleet, io`;
2. `fleet.init()` (roles auto-detected: the fleetlike launcher, torchrun, mpiexec, Slurm) and
   the device it chose for this worker (its GPU, else the CPU);
3. the training loader from `io.get_data_loader`: this worker's shard of the training set (a
   resumable `DistributedSampler` over `fleet.worker_num()` shards, `set_epoch` each epoch
   reshuffles), the next batches prefetched onto the device, the time each step waited on data
   (`train_loader.epoch_wait`, and fleetlike's slow-rank report);
4. `model = fleet.distributed_model(model)`: gradients averaged over the workers in `backward()`;
5. `optimizer = fleet.distributed_optimizer(optimizer)`: still a torch optimizer (StepLR works);
6. save on rank 0 only.

The strategy is the default (data parallel); FLEETLIKE_STRATEGY (JSON) changes it without
editing the script. Every worker tests on the whole test set and prints the same result.

    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/pytorch_mnist/main_fleet.py --epochs 1
    torchrun --nproc_per_node=2 examples/pytorch_mnist/main_fleet.py --epochs 1
    mpiexec -n 2 python examples/pytorch_mnist/main_fleet.py --epochs 1
"""
import argparse
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from fleetlike import fleet, io


def synthetic_mnist(train, size):
    """A TensorDataset of MNIST's shape: each class is a fixed random stroke pattern; an image is
    its class's pattern at half to full strength, shifted by up to a pixel, under uniform noise; normalized
    as the original's transforms.Normalize((0.1307,), (0.3081,)). Deterministic."""
    patterns = (torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.85).float()
    g = torch.Generator().manual_seed(1 if train else 2)
    target = torch.randint(0, 10, (size,), generator=g)
    shifts = torch.randint(-1, 2, (size, 2), generator=g)
    strength = 0.5 + 0.5 * torch.rand(size, 1, 1, 1, generator=g)
    images = torch.stack([torch.roll(patterns[t], (int(dy), int(dx)), dims=(1, 2))
                          for t, (dy, dx) in zip(target.tolist(), shifts)])
    data = (strength * images + 0.5 * torch.rand(size, 1, 28, 28, generator=g)).clamp(0, 1)
    return torch.utils.data.TensorDataset((data - 0.1307) / 0.3081, target)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
        test_loss, correct, len(test_loader.dataset),
        100. * correct / len(test_loader.dataset)))


def main():
    # Training settings
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
    parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                        help='input batch size for training (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                        help='input batch size for testing (default: 1000)')
    parser.add_argument('--epochs', type=int, default=14, metavar='N',
                        help='number of epochs to train (default: 14)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--no-cuda', action='store_true', default=False,
                        help='disables CUDA training')
    parser.add_argument('--dry-run', action='store_true', default=False,
                        help='quickly check a single pass')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                        help='how many batches to wait before logging training status')
    parser.add_argument('--save-model', action='store_true', default=False,
                        help='For Saving the current Model')
    parser.add_argument('--train-size', type=int, default=60000, metavar='N',
                        help='synthetic training images (default: 60000, as MNIST)')
    parser.add_argument('--test-size', type=int, default=10000, metavar='N',
                        help='synthetic test images (default: 10000, as MNIST)')
    args = parser.parse_args()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    torch.manual_seed(args.seed)

    fleet.init()
    device = fleet.device()

    train_kwargs = {'batch_size': args.batch_size}
    test_kwargs = {'batch_size': args.test_batch_size}
    if use_cuda:
        cuda_kwargs = {'num_workers': 1,
                       'pin_memory': True,
                       'shuffle': True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)

    dataset1 = synthetic_mnist(train=True, size=args.train_size)
    dataset2 = synthetic_mnist(train=False, size=args.test_size)
    train_loader = io.get_data_loader(dataset1, **train_kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    model = fleet.distributed_model(model)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    optimizer = fleet.distributed_optimizer(optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_loader.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model and fleet.worker_index() == 0:
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == '__main__':
    main()
