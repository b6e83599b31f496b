//! The error word a kernel records in the status block, and the error it becomes on the host.

use crate::error::{mkResult_t, MkError};
use crate::kernel_abi::{MkOp, MkWait};

/// An error word from the status block: bits 0-7 mkResult_t, 8-15 the peer rank involved
/// (0xff none), 16-23 what was awaited, 24-31 the op (kernels/common/signals.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorWord(pub u32);

impl ErrorWord {
    pub fn encode(code: mkResult_t, peer: Option<usize>, what: u32, op: u32) -> ErrorWord {
        ErrorWord(
            (code as u32 & 0xff)
                | ((peer.map_or(0xff, |p| p as u32) & 0xff) << 8)
                | ((what & 0xff) << 16)
                | ((op & 0xff) << 24),
        )
    }
    pub fn code(self) -> mkResult_t {
        match self.0 & 0xff {
            0 => mkResult_t::mkInternalError,
            c => mkResult_t::from_i32(c as i32),
        }
    }
    pub fn peer(self) -> Option<usize> {
        match (self.0 >> 8) & 0xff {
            0xff => None,
            p => Some(p as usize),
        }
    }
    fn op_name(self) -> String {
        match MkOp::from_u32(self.0 >> 24) {
            Some(op) => op.api_name().into(),
            None => format!("fused op {}", self.0 >> 24),
        }
    }
    fn what(self) -> Option<MkWait> {
        MkWait::from_u32((self.0 >> 16) & 0xff)
    }
    fn awaited(self) -> &'static str {
        match self.what() {
            Some(MkWait::Ready) => "its staged data",
            Some(MkWait::Ready2) => "its reduced slice",
            Some(MkWait::Free) => "it to finish reading this rank's workspace slot",
            Some(MkWait::OpFlag) => "a fused-op flag",
            Some(MkWait::Net) => "its data over the network",
            Some(MkWait::Grant) => "it to free its slot for this rank's put over the network",
            Some(MkWait::Proxy) => "this rank's inter-node proxy",
            _ => "a signal",
        }
    }
    /// The error mkCommGetAsyncError reports, with a message for mkGetLastError.
    pub fn to_error(self, rank: usize) -> MkError {
        let op = self.op_name();
        let peer = self.peer().map_or("a peer".to_string(), |p| format!("rank {p}"));
        let what = self.what();
        match self.code() {
            // kernels/moe.cu: errors found in the inputs on the device.
            mkResult_t::mkInvalidUsage if what == Some(MkWait::MoeExpert) => MkError::invalid_usage(format!(
                "{op} on rank {rank}: topkIdx holds an expert id outside [-1, E); those choices were dropped. Recreate the communicator"
            )),
            // kernels/hier_collectives.cu: this rank's proxy failed; the proxy's own
            // message is in mkGetLastError once the host reads it.
            code if what == Some(MkWait::Proxy) => MkError::new(code, format!(
                "{op} on rank {rank} stopped: its inter-node proxy failed ({code:?}) while sending to or waiting for {peer} \
                 (a lost connection, a ring that stayed full, or a transfer that did not complete within MK_TIMEOUT_MS). \
                 Abort and recreate the communicator"
            )),
            mkResult_t::mkTimeout => MkError::timeout(format!(
                "{op} on rank {rank} timed out waiting for {peer} ({}) after MK_TIMEOUT_MS; that rank is stuck, \
                 never made the call, or died. Abort and recreate the communicator",
                self.awaited()
            )),
            mkResult_t::mkRemoteError => MkError::remote(format!(
                "{op} on rank {rank} stopped because {peer} failed or aborted (it raised the communicator's abort flag). \
                 Abort and recreate the communicator"
            )),
            mkResult_t::mkInvalidUsage => MkError::invalid_usage(format!("{op} on rank {rank} stopped: the communicator was aborted (mkCommAbort)")),
            code => MkError::new(code, format!("{op} on rank {rank} recorded error word {:#010x}", self.0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_words_decode_to_codes_and_messages() {
        let w = ErrorWord::encode(mkResult_t::mkTimeout, Some(3), 1, 1);
        assert_eq!(w.code(), mkResult_t::mkTimeout);
        assert_eq!(w.peer(), Some(3));
        let e = w.to_error(0);
        assert_eq!(e.code, mkResult_t::mkTimeout);
        assert!(e.message.contains("mkAllGather on rank 0 timed out waiting for rank 3"), "{}", e.message);
        let r = ErrorWord::encode(mkResult_t::mkRemoteError, Some(1), 3, 3).to_error(2);
        assert_eq!(r.code, mkResult_t::mkRemoteError);
        assert!(r.message.contains("mkAllReduce on rank 2 stopped because rank 1"), "{}", r.message);
        let a = ErrorWord::encode(mkResult_t::mkInvalidUsage, None, 2, 2);
        assert_eq!(a.peer(), None);
        assert_eq!(a.to_error(0).code, mkResult_t::mkInvalidUsage);
        // The kernel's encoding (signals.cuh mk_error_word) is the same bit layout.
        assert_eq!(ErrorWord::encode(mkResult_t::mkTimeout, Some(2), 3, 2).0, 8 | (2 << 8) | (3 << 16) | (2 << 24));
        assert_eq!(ErrorWord(0x42).code(), mkResult_t::mkInternalError);
        // kernels/moe.cu: a bad expert id (what 6).
        assert!(ErrorWord::encode(mkResult_t::mkInvalidUsage, Some(0), 6, 19)
            .to_error(0)
            .message
            .contains("outside [-1, E)"));
        assert!(ErrorWord::encode(mkResult_t::mkTimeout, Some(2), 4, 20)
            .to_error(0)
            .message
            .contains("mkMoeGemmCombine on rank 0 timed out waiting for rank 2"));
        // kernels/hier_collectives.cu: network waits and proxy failures.
        let net = ErrorWord::encode(mkResult_t::mkTimeout, Some(5), 7, 1).to_error(1);
        assert!(
            net.message.contains("mkAllGather on rank 1 timed out waiting for rank 5 (its data over the network)"),
            "{}",
            net.message
        );
        let proxy = ErrorWord::encode(mkResult_t::mkRemoteError, Some(2), 9, 3).to_error(0);
        assert_eq!(proxy.code, mkResult_t::mkRemoteError);
        assert!(proxy.message.contains("inter-node proxy failed"), "{}", proxy.message);
    }
}
