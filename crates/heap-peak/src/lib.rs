//! Test support: an allocator that counts, per thread, the live heap bytes and their peak,
//! so a property test can assert that a parser or decoder fed hostile input stays within a
//! memory bound. A test crate installs it with
//! `#[global_allocator] static A: heap_peak::Counting = heap_peak::Counting;` and measures
//! with [`peak_heap`]. Per thread, so tests running in parallel do not count each other's
//! allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // `try_with`: allocations during thread teardown are not counted, never a panic.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Runs `f`; returns its result and the most heap it held at once on this thread, in
/// bytes above what was live when it started.
pub fn peak_heap<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, usize::try_from(peak - start).unwrap_or(0))
}

/// The heap bytes live on this thread: allocated here and not yet freed (here). A
/// difference of two readings is what was kept in between, by code that ran on this thread.
pub fn live_heap() -> isize {
    LIVE.with(Cell::get)
}

#[cfg(test)]
mod tests {
    #[global_allocator]
    static ALLOCATOR: super::Counting = super::Counting;

    #[test]
    fn peak_heap_counts_what_is_held_at_once_on_this_thread() {
        let (len, peak) = super::peak_heap(|| {
            let a = vec![1u8; 1 << 20];
            let b = vec![2u8; 1 << 19];
            a.len() + b.len()
        });
        assert_eq!(len, 3 << 19);
        assert!((3 << 19..(3 << 19) + 4096).contains(&peak), "{peak}");
        let (_, freed_first) = super::peak_heap(|| {
            drop(vec![1u8; 1 << 20]);
            drop(vec![1u8; 1 << 20]);
        });
        assert!((1 << 20..(1 << 20) + 4096).contains(&freed_first), "{freed_first}");
    }
}
