// Package readahead puts a readahead buffer in front of an [io.ReaderAt]:
// it turns long runs of small, adjacent reads into a few large ones, and
// passes every other read straight through.
//
// Its main user is a compressed qcow2 image. Compressed clusters are packed
// back to back in the image file, each is read with one ReadAt of a few KiB
// to ~64 KiB, and consecutive clusters share their boundary sector, so a
// sequential scan of the guest disk issues a long run of small reads, each
// starting up to 511 bytes before the previous one ended. Several workers
// may inflate consecutive clusters at once, so the reads of one scan can
// arrive slightly out of order. Random guest reads, meanwhile, issue isolated
// small reads that must not cost any extra I/O. Nothing here knows about
// qcow2, though: any io.ReaderAt over data that does not change will do.
// There is nothing to tell a [Reader] about the reads; it finds the
// sequential ones by itself.
//
// # Streams
//
// A Reader tracks up to Options.MaxStreams sequential streams, each with up
// to two windows: contiguous buffers, each filled by one underlying ReadAt.
// A read belongs to the stream whose windows hold its first byte, or else
// to one whose windows (or last read) it comes within MinWindow/2 bytes of,
// so a few interleaved sequential readers each keep their own windows.
//
// A read that belongs to no stream is random: it is served by exactly one
// ReadAt of exactly the bytes asked for, with no buffer, and leaves the
// streams alone. The Reader remembers where recent such reads ended (a
// ring of 4*MaxStreams runs), and the third read in a row that starts
// within 4 KiB of where the previous one ended (overlapping it or just
// after it) starts a stream. Two random reads are adjacent now and then,
// three in a row hardly ever, so random reads cost nothing extra, and a
// scan pays for two small direct reads before it is buffered.
//
// When all slots are in use, the least recently read stream makes way for
// a new one, but only if it is stale: unread for more than twice its usual
// interval between reads (counted in calls), or only read now and then
// (say, by random reads landing on the windows of a finished scan). A
// stream merely waiting its turn among more interleaved streams than there
// are slots keeps its slot, and the newcomer is read directly, rather than
// have streams evict each other in turn, each fetching a window for a read
// or two. A stream nobody reads for Options.IdleTime (2 seconds by default)
// is forgotten and its buffers released, so a Reader whose scan has
// finished holds no memory.
//
// # Windows, growth and prefetch
//
// A stream moves on by how much of its last window has been read, not by
// where reads land, which parallel workers make unreliable: once half of
// the last window has been served, the next window is fetched in a new
// goroutine (prefetch), replacing the older window if the stream has two.
// A read that needs bytes being fetched waits for that fetch, so the same
// bytes are never fetched twice at once, and a sequential reader finds its
// next bytes fetched or in flight. Random reads that fall on a stream's
// windows are served from them, but add too few bytes to move it on.
//
// The first window is MinWindow bytes (128 KiB by default); each prefetched
// window is twice the one before, up to MaxWindow (4 MiB by default). A
// window dropped with less than half of it read (the reader skipped ahead,
// or stopped being sequential) halves the size. A window is also as large
// as needed for the read it is fetched for; reads longer than MaxWindow
// pass straight through.
//
// A read running off the end of the last window while the stream is
// consuming it (a quarter of it read, or still being fetched), or starting
// just past it, fetches the next window itself, contiguous with the last:
// the prefetch did not start in time, or parallel workers ran ahead. A late
// read before a stream's first window (a worker that lost a race to its
// neighbours by more than a window) is read directly. A read only counts
// for a stream when the stream's windows serve it, so a stream whose reads
// went elsewhere stops matching them, and they start a new one.
//
// # Errors and end of data
//
// The bytes returned are always the underlying reader's bytes, and the error
// is always one the underlying reader would return for the same call. A
// window whose fetch failed keeps the bytes it did read and is dropped from
// its stream; a read needing bytes past the failure re-reads its own range
// directly, so an error reaches only the callers whose ranges it affects,
// and a later read simply fetches again. A window that met the end of the
// data (io.EOF, possibly with n > 0) records where the data ends: reads past
// it get io.EOF, and no window is fetched there.
//
// The data must not change while it is read through a Reader: a window is
// never refreshed, so a change after a window was fetched goes unseen, and
// data that grows past a recorded end still reads as ending there.
//
// # Memory
//
// Window buffers come in the sizes MinWindow, 2*MinWindow, ..., MaxWindow
// and are recycled through one [sync.Pool] per size, so a read served from
// a window allocates nothing, and buffers a Reader no longer uses are left
// to the garbage collector. The bytes of buffers in use (held by a stream, a
// fetch in flight or a read copying out) never exceed
// MaxStreams * 2 * MaxWindow (64 MiB with the defaults). A window that does
// not fit first takes the windows of stale streams; if it still does not
// fit, it is not fetched, and its read goes directly to the underlying
// reader. [Reader.Stats] reports the buffers in use and their peak, and how
// many underlying reads the calls cost.
//
// # Concurrency
//
// A Reader is safe for concurrent use. One mutex guards the streams, the
// windows' bookkeeping and the buffer pool; it is held only for that
// bookkeeping, never during an underlying read or while copying bytes out.
// A read pins the windows it needs (a reference count) under the mutex,
// waits for their fetches if needed, and copies without the lock.
// [Reader.Close] forgets every stream, waits for prefetches in flight and
// releases the buffers; reads after Close go straight to the underlying
// reader.
package readahead
