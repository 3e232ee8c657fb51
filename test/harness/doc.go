// Package harness is what qcowfs's end-to-end test packages share: each
// one's TestMain is Main, which builds the binary under test once per
// package run (and with QCOWFS_TEST_RACE=1 a race-detecting build, whose
// reports fail the run).
//
//   - main.go: Main, the binary, the requirements of a test (RequireFUSE),
//     a folder of images to mount (SourceDir).
//   - cli.go: running the binary, qemu-img and other tools with a timeout
//     (Run, Exec, RunCmd, Result); the shape of a user error; qemu-img
//     beside qcowfs for info, map and check (Both, SameAsQemu).
//   - mount.go: mounts made by the tests (Mount, a Daemon's TryMount) and
//     their logs, the daemons behind them (Daemons, DaemonOf), unmounting
//     (WantUnmount), the mount table.
//   - status.go: qcowfs status --output=json, decoded.
//   - proc.go: what /proc says of a daemon (memory, descriptors, CPU).
//   - wait.go: waiting for a condition (WaitFor), and bounding a request
//     that must not hang (Within).
//   - files.go: what a mount shows: names, files opened for the test (Open,
//     OpenFile), bytes, data runs (SeekRuns, FileRuns), data an encrypted
//     image must not hold in the clear (NotInClear).
//   - guest.go: guest disks with an ext4 file system, partition tables
//     (Partition), loop devices over a mount's files, the guest mounted,
//     read back and checked (Fsck).
//
// Images are made, and qemu is asked what they hold, with package
// test/qemu; servers for remote images are in test/servers.
package harness
