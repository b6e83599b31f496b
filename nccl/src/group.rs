//! ncclGroupStart / ncclGroupEnd bookkeeping, per thread as in NCCL: the depth, and the
//! work a group holds back until its outermost ncclGroupEnd — communicator inits
//! (standalone), mkernel attaches to real communicators (interpose) and collectives.

use crate::collectives::Queued;
use crate::error::{NcclError, Result};
use crate::handle::CommHandle;
use crate::init::InitJob;
use std::cell::RefCell;
use std::sync::Arc;

/// What an outermost ncclGroupEnd releases, in call order per kind.
#[derive(Default)]
pub struct GroupWork {
    pub inits: Vec<InitJob>,
    pub attaches: Vec<Arc<CommHandle>>,
    pub ops: Vec<Queued>,
}

#[derive(Default)]
struct GroupState {
    depth: u32,
    work: GroupWork,
}

thread_local! {
    static GROUP: RefCell<GroupState> = RefCell::new(GroupState::default());
}

pub fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

pub fn depth() -> u32 {
    GROUP.with(|g| g.borrow().depth)
}

pub fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Closes one level; returns the held work when it was the outermost.
pub fn end() -> Result<Option<GroupWork>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(NcclError::invalid_usage("ncclGroupEnd called without a matching ncclGroupStart"));
        }
        g.depth -= 1;
        Ok((g.depth == 0).then(|| std::mem::take(&mut g.work)))
    })
}

pub fn defer_init(job: InitJob) {
    GROUP.with(|g| g.borrow_mut().work.inits.push(job));
}

pub fn defer_attach(h: Arc<CommHandle>) {
    GROUP.with(|g| g.borrow_mut().work.attaches.push(h));
}

pub fn defer_op(q: Queued) {
    GROUP.with(|g| g.borrow_mut().work.ops.push(q));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::CollOp;

    #[test]
    fn nesting_releases_work_at_the_outermost_end_only() {
        assert!(!in_group());
        assert!(end().err().unwrap().message.contains("without a matching ncclGroupStart"));
        start();
        start();
        let h = CommHandle::new(0, 1, 0, true, None);
        defer_op(Queued { comm: h.clone(), op: CollOp::AllGather { send: 1, recv: 2, count: 3, dtype: 7 }, stream: 0 });
        defer_attach(h);
        assert_eq!(depth(), 2);
        assert!(end().unwrap().is_none(), "inner end holds the work");
        let w = end().unwrap().expect("outer end releases it");
        assert_eq!((w.ops.len(), w.attaches.len(), w.inits.len()), (1, 1, 0));
        assert!(!in_group());
        start();
        assert!(end().unwrap().unwrap().ops.is_empty(), "each group starts empty");
    }
}
