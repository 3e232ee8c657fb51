// Package qemuimg prints what qemu-img info, map and check print, byte for
// byte, from package qcow2's answers (qcow2.Info, qcow2.MapEntry,
// qcow2.CheckResult) and from raw files, so that scripts written for
// qemu-img work unchanged on qcowfs info, map and check.
//
// qemu prints its JSON from a QDict, a hash table, so keys come in the
// table's order (qobject.go reproduces it); the human forms follow
// qemu-img.c and block/qapi.c. What the package does not do: open images,
// parse flags or choose exit statuses beyond check's (CheckStatus); the
// command does that. The tests compare every output with qemu-img's on
// qemu-made images: qemu is the oracle.
//
// Files: info.go (info, human form; raw files), map.go (map, both forms;
// raw files), bitmap.go (a persistent bitmap's map, as qemu-img map prints
// it over qemu-nbd -B), check.go (check's summary and exit status),
// qobject.go (qemu's JSON and its QDict order).
package qemuimg
