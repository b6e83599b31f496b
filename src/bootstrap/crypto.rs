//! SHA-256 and HMAC-SHA256 for the handshakes and frame MACs, from RustCrypto's `sha2` and
//! `hmac` crates (audited, constant-time tag comparison through `Mac::verify_slice`).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Bytes of an HMAC-SHA256 tag.
pub const TAG_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

fn keyed(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length (longer ones are hashed first), so this cannot fail.
    let mut mac =
        <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    for p in parts {
        mac.update(p);
    }
    mac
}

/// SHA-256 of the concatenation of `parts`.
pub fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; TAG_BYTES] {
    keyed(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the HMAC-SHA256 of `parts` under `key`, compared in constant time.
pub fn hmac_sha256_verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, parts).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// RFC 4231, section 4: every HMAC-SHA-256 test case (case 5's output is truncated to
    /// 128 bits in the RFC, so only that prefix is compared).
    #[test]
    fn hmac_sha256_matches_every_rfc4231_test_case() {
        let long_key = vec![0xaa; 131];
        let cases: Vec<(Vec<u8>, Vec<u8>, &str)> = vec![
            (vec![0x0b; 20], b"Hi There".to_vec(), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?".to_vec(),
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (vec![0xaa; 20], vec![0xdd; 50], "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
            (
                unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"),
                vec![0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
            (vec![0x0c; 20], b"Test With Truncation".to_vec(), "a3b6167473100ee06e0c796c2955552b"),
            (
                long_key.clone(),
                b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec(),
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
            (
                long_key,
                b"This is a test using a larger than block-size key and a larger than block-size data. The key needs \
                  to be hashed before being used by the HMAC algorithm."
                    .to_vec(),
                "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
            ),
        ];
        for (i, (key, data, expected)) in cases.iter().enumerate() {
            let expected = unhex(expected);
            let tag = hmac_sha256(key, &[data]);
            assert_eq!(&tag[..expected.len()], &expected[..], "RFC 4231 test case {}", i + 1);
            // The same input split anywhere gives the same tag.
            let (a, b) = data.split_at(data.len() / 3);
            assert_eq!(hmac_sha256(key, &[a, b]), tag, "test case {} split", i + 1);
            if expected.len() == TAG_BYTES {
                assert!(hmac_sha256_verify(key, &[data], &expected), "test case {} verifies", i + 1);
                let mut wrong = expected.clone();
                wrong[31] ^= 1;
                assert!(!hmac_sha256_verify(key, &[data], &wrong), "test case {}: a flipped bit fails", i + 1);
                assert!(!hmac_sha256_verify(key, &[data], &expected[..31]), "test case {}: a short tag fails", i + 1);
            }
        }
    }

    /// FIPS 180-4 examples (the "abc" and two-block messages).
    #[test]
    fn sha256_matches_fips_examples() {
        assert_eq!(
            sha256(&[b"abc"]).to_vec(),
            unhex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        );
        assert_eq!(
            sha256(&[b"abcdbcdecdefdefgefghfghighij", b"hijkijkljklmklmnlmnomnopnopq"]).to_vec(),
            unhex("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")
        );
    }
}
